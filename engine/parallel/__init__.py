"""Tensor parallelism over torch.distributed (docs/tensor_parallel.md): `group` (the ranks' process
groups), `sharding` (each rank's slice of the config and of the checkpoint), `layers` (the collectives
around the sharded model), `runner` (the model runner of every rank; rank 0 broadcasts each step's
`engine.runner.step_plan`), `launch` (rank 0 starting or joining the others) and `rank_main` (the
process of a rank other than 0)."""
