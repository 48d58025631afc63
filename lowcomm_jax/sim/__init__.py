"""The simulator's clock, worker speeds, network links and schedules (plain Python and numpy; JAX
only to read results back): when things happen. What happens (real inner steps, outer rules) is
lowcomm_jax/runtimes/simulator/backend.py, driven by lowcomm_jax/runtimes/simulator/simulate.py."""

from lowcomm_jax.sim.async_schedules import AsyncWorkers
from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.sim.network import Network
from lowcomm_jax.sim.schedules import Accounting, Backend, Job, Plan, Schedule
from lowcomm_jax.sim.speeds import HETEROGENEITY, SpeedModel, level_speeds
from lowcomm_jax.sim.sync_schedules import GossipRounds, StreamingRounds, SyncRounds
