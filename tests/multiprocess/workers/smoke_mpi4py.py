"""Smoke worker: an MPI collective through mpi4py."""

import json

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1, op=MPI.SUM)
print(json.dumps({"rank": comm.Get_rank(), "size": comm.Get_size(), "sum": total}), flush=True)
