"""The pure planning core: typed values in, typed plans out. No I/O, no gRPC.

The flow of one plan, in `kvplan.core.planner.plan_engine`:
validate -> merge workers' specs -> group -> annotate draft groups ->
budget every worker -> size blocks and tensors -> capacity.
"""
