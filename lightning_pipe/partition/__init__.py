"""Which layers each pipeline stage holds: the balance (by parameters, layers or measured time),
the model's partition into stages with its tied weights and aliases, and the layer profiler."""
