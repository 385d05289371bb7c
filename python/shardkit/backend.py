"""The ``"shardkit"`` torch.distributed backend as torch and users reach it.

It promises: ``register_backend()`` (run by ``import shardkit``) registers ``"shardkit"`` with torch.distributed,
once, with the creator of ``_startup.py`` (through ``_shardkit_autoload``, which torch's extension autoloading also
calls at ``import torch``: one registration however the backend is found); the backends of groups nobody
destroyed are shut down at exit, while the interpreter still runs; and the backend's public names stay importable
from here (``shardkit.backend.X``), each kept in the module of its concern:

- ``_startup.py``: the start-up ``init_process_group`` runs per group (the creator, bounded by the start-up watch);
- ``_topology.py``: how a group's ranks sit on hosts: ``host_id``, ``HostTopology``, ``host_topology``,
  ``inter_host_scheme``, ``inter_host_bytes``, ``host_groups``;
- ``_zero_copy.py``: shared memory collectives read in place: ``shared_buffer``, ``zero_copy_unavailable``,
  ``warn_zero_copy_unavailable``, ``ZeroCopyUnavailableWarning``;
- ``_direct_allreduce.py``: ``all_reduce_``, the allreduce without torch's dispatch;
- ``_group_backend.py``: ``cpu_backend``, a group's own backend;
- ``_collective_identity.py``: ``compare_identities_across_hosts``.

Environment: SHARDKIT_SHM_SLOT_BYTES and SHARDKIT_SHM_TAG (``_startup.py``), SHARDKIT_HOST_ID and SHARDKIT_INTER_HOST
(``_topology.py``).
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from _shardkit_autoload import BACKEND_NAME
from _shardkit_autoload import register as register_backend

from . import _C, _torch_compat
from ._collective_identity import compare_identities_across_hosts
from ._direct_allreduce import all_reduce_
from ._group_backend import cpu_backend
from ._topology import HostTopology, host_groups, host_id, host_topology, inter_host_bytes, inter_host_scheme
from ._zero_copy import ZeroCopyUnavailableWarning, shared_buffer, warn_zero_copy_unavailable, zero_copy_unavailable

__all__ = ["BACKEND_NAME", "HostTopology", "ZeroCopyUnavailableWarning", "all_reduce_",
           "compare_identities_across_hosts", "cpu_backend", "host_groups", "host_id", "host_topology",
           "inter_host_bytes", "inter_host_scheme", "register_backend", "shared_buffer", "warn_zero_copy_unavailable",
           "zero_copy_unavailable"]


@atexit.register
def _shut_down_at_exit() -> None:
    """Shuts down the backends of groups nobody destroyed (destroy_process_group() is optional in torch), while the
    interpreter still runs: their worker threads finish what is queued and end. One left running into the
    interpreter's finalization would drop a tensor there (taking the GIL), be ended mid-destructor, and abort the
    process at exit."""
    if not dist.is_available() or not dist.is_initialized():
        return
    for group in _torch_compat.live_process_groups():  # the groups not destroyed yet
        backend = cpu_backend(group)
        if isinstance(backend, _C.ProcessGroupShardkit):
            backend.shutdown_now()
