"""The MPI backend of the `Communicator`: torch CPU tensors over mpi4py (every CPU run and test).

* `trainer.comm.mpi.communicator`  `MpiCommunicator`: collectives, p2p, split
* `trainer.comm.mpi.buffers`       staged tensors, request handles, ``Alltoallv`` vector specs
* `trainer.comm.mpi.vote`          `LateMax`: a MAX of one integer, posted now, read a step later
"""
