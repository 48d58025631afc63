"""The Ray runtime (`runtime='ray'`): a parameter-server actor and one JAX process per worker,
on real processes that may join, leave or crash mid-run. driver.py holds what every mode
shares; the algorithm's progress picks the mode (pushes.py, quorum.py, epochs.py). checks.py
and chaos.py are plain Python; Ray is imported by cluster.py alone (pool.py and driver.py
get it from `cluster.import_ray`)."""
