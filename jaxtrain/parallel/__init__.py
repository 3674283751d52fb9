"""Device-mesh parallelism: the mesh and its logical axis rules, pipeline schedules, multi-host start-up."""
