"""The shared layer below model/outer/compress/aggregate/sim/data: meshes, collectives, bytes,
the masked weighted mean and the parameter servers' names."""
