"""The pure planning core: typed values in, typed plans out. No I/O, no gRPC.

The flow of one plan, in `kvplan.core.planner`: `plan_model` (what depends on the
model and the engine's settings alone) validate -> merge workers' specs -> group ->
annotate draft groups -> project onto each worker; then `plan_engine` budget every
worker -> size blocks and tensors -> capacity.
"""
