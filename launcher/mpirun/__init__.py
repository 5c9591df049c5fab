"""``dtrain launch --launcher mpirun``: the same plan, started by the site's MPI launcher.

* `launcher.mpirun.command`   the plan as an mpiexec (Hydra) or Open MPI mpirun command
* `launcher.mpirun.rankshim`  run in place of each rank's program: contract, interfaces, abort
* `launcher.mpirun.job`       the transport table's `mpirun` entry: build, print or run it
"""
