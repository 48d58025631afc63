"""The Ray runtime (`runtime='ray'`): one JAX process per worker, on real processes that may
join, leave or crash mid-run, and one driver process. Synchronous rounds close among their
workers, each holding a replica of θ (the peer form: replicas.py, replica.py), in the
collective form `forms/` picks, the members moving the bytes among themselves; parameter-
server actors run the asynchronous algorithms and the server form
(`collective_form='server'`: forms/server.py). driver.py holds what every mode shares; the
algorithm's progress picks the mode (pushes.py, quorum.py, epochs.py), and the mode is
given its form (the server's, or the replicas'). checks.py and chaos.py are plain Python;
Ray is imported by cluster.py alone (pool.py, driver.py and the workers' transport get it
from `cluster.import_ray`)."""
