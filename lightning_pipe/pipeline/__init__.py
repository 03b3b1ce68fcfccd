"""Pipeline parallelism: schedules as data, their validator and simulator, partitioning, executor."""
