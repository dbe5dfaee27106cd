"""``numba.cuda``, imported only after the world (GPU or simulator) has been chosen.

Every module of the package that needs numba.cuda imports it from here, so the first
such import, wherever it happens, switches the simulator on when there is no GPU.
"""

from numba_flash._world import choose_world

choose_world()

from numba import cuda, float32, int32, uint64  # noqa: E402

from numba_flash import simulator  # noqa: E402

simulator.install()  # in the simulator only: a block scheduler without polling, cheap device calls

__all__ = ["cuda", "float32", "int32", "uint64"]
