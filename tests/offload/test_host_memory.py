"""available_host_bytes: /proc/meminfo's MemAvailable within the cgroup limits of the process,
read from folders laid out like /proc and /sys."""

from __future__ import annotations

from pathlib import Path

import pytest

from shuttle.offload.host_memory import available_host_bytes

GIB = 2**30


def layout(root: Path, meminfo: str | None = "MemTotal: 33554432 kB\nMemAvailable: 25165824 kB\n",
           cgroup: str | None = None, files: dict[str, str] | None = None) -> Path:
    """``root`` laid out as /proc and /sys (MemAvailable 24 GiB by default)."""
    if meminfo is not None:
        (root / "proc").mkdir(parents=True, exist_ok=True)
        (root / "proc/meminfo").write_text(meminfo)
    if cgroup is not None:
        (root / "proc/self").mkdir(parents=True, exist_ok=True)
        (root / "proc/self/cgroup").write_text(cgroup)
    for path, text in (files or {}).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_without_a_cgroup_limit_it_is_memavailable(tmp_path):
    assert available_host_bytes(layout(tmp_path)) == 24 * GIB
    v2_unlimited = layout(tmp_path / "v2", cgroup="0::/user.slice\n", files={
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/memory.current": str(30 * GIB)})
    assert available_host_bytes(v2_unlimited) == 24 * GIB
    v1_unlimited = layout(tmp_path / "v1", cgroup="4:memory:/job\n", files={
        "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/job/memory.usage_in_bytes": str(GIB)})
    assert available_host_bytes(v1_unlimited) == 24 * GIB


def test_an_old_kernel_without_memavailable_gives_memfree(tmp_path):
    assert available_host_bytes(layout(tmp_path, "MemTotal: 100 kB\nMemFree: 64 kB\n")) == 65536


def test_a_system_without_proc_meminfo_says_nothing(tmp_path):
    assert available_host_bytes(layout(tmp_path, meminfo=None)) is None


def test_a_container_limit_below_memavailable_wins(tmp_path):
    # cgroup v2: 16 GiB limit, 10 GiB used of which 2 GiB is page cache it can drop
    root = layout(tmp_path, cgroup="0::/docker/abc\n", files={
        "sys/fs/cgroup/docker/abc/memory.max": str(16 * GIB),
        "sys/fs/cgroup/docker/abc/memory.current": str(10 * GIB),
        "sys/fs/cgroup/docker/abc/memory.stat": f"anon 1\ninactive_file {2 * GIB}\n"})
    assert available_host_bytes(root) == 8 * GIB


def test_the_tightest_of_the_cgroup_and_its_ancestors_wins(tmp_path):
    root = layout(tmp_path, cgroup="0::/slurm/job7/step0\n", files={
        "sys/fs/cgroup/slurm/job7/step0/memory.max": "max",
        "sys/fs/cgroup/slurm/job7/step0/memory.current": str(GIB),
        "sys/fs/cgroup/slurm/job7/memory.max": str(12 * GIB),
        "sys/fs/cgroup/slurm/job7/memory.current": str(4 * GIB),
        "sys/fs/cgroup/slurm/memory.max": str(20 * GIB),
        "sys/fs/cgroup/slurm/memory.current": str(6 * GIB)})
    assert available_host_bytes(root) == 8 * GIB


def test_cgroup_v1_memory_controller(tmp_path):
    root = layout(tmp_path, cgroup="5:cpu,cpuacct:/\n4:memory:/job\n0::/\n", files={
        "sys/fs/cgroup/memory/job/memory.limit_in_bytes": str(6 * GIB),
        "sys/fs/cgroup/memory/job/memory.usage_in_bytes": str(5 * GIB)})
    assert available_host_bytes(root) == GIB


@pytest.mark.parametrize("usage", [7 * GIB, 9 * GIB])
def test_a_cgroup_at_or_past_its_limit_leaves_nothing(tmp_path, usage):
    root = layout(tmp_path, cgroup="0::/\n", files={
        "sys/fs/cgroup/memory.max": str(8 * GIB), "sys/fs/cgroup/memory.current": str(usage)})
    assert available_host_bytes(root) == max(0, 8 * GIB - usage)


def test_this_machine_says_something_plausible():
    got = available_host_bytes()
    if not Path("/proc/meminfo").exists():
        assert got is None
    else:
        assert 0 < got < 2**50
