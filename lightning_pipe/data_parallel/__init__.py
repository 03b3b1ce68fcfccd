"""Data parallelism: keeping model replicas identical across the data axis of the mesh."""
