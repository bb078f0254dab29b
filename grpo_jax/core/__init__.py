"""The bottom layer: errors, config checks, the mesh and batch layouts, hosts, statistics."""
