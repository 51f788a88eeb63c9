"""Expert parallelism: router, dispatch/combine backends, the MoE layer, placement and its tuner."""
