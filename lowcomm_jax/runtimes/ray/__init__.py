"""The Ray runtime (`runtime='ray'`): a parameter-server actor and one JAX process per worker,
asynchronous algorithms on real processes, workers that join, leave or crash mid-run
(driver.py). checks.py and chaos.py are plain Python; Ray is imported by cluster.py alone
(pool.py and driver.py get it from `cluster.import_ray`)."""
