"""From a checked config to a `Run`: the host table, model and data shapes, the programs (pure,
then jitted), the memory pre-check and the virtual workers' plan. No compute."""
