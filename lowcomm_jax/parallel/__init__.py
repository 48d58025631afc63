"""The shared layer below model/outer/compress/aggregate/sim/data: meshes, collectives, bytes."""
