"""The pure planning core: typed values in, typed plans out. No I/O, no gRPC.

The flow of one plan: `kvplan.core.model_plan.plan_model` (what depends on the
model and the engine's settings alone) validate -> merge workers' specs -> group ->
annotate draft groups -> project onto each worker; then `kvplan.core.planner.plan_engine`
(its steps in docs/how-a-plan-is-made.md) budget every
worker -> size blocks and tensors -> capacity.
"""
