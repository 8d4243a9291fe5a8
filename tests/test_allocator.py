"""The allocator a rank runs with (``parallel/memory.py``, :func:`configure_allocator`).

Every rank fixes glibc's mmap threshold (per-rank peaks that do not depend on allocation
order) and asks PyTorch's CPU allocator for transparent huge pages, without which each
fresh tile buffer is faulted in 4 KiB at a time (with them a 1x2 ResNet-50 step at 768² is
18 % shorter, ``docs/benchmarks.md``). PyTorch reads its switch once, at a process's first CPU tensor, so
each case runs in a new interpreter, and the commands must set it up before anything they
import makes a tensor (``torch.distributed.pipelining`` does, at import).

What is checked is PyTorch's decision, seen in the alignment it gives a 4 MiB buffer (a page
with huge pages asked for, 64 bytes without); whether the kernel grants them is its own
setting.
"""

from __future__ import annotations

import importlib
import os

import pytest
from fresh import in_fresh_process

_SWITCH = "THP_MEM_ALLOC_ENABLE"


def _page_aligned() -> bool:
    import torch

    return torch.empty(4 << 20, dtype=torch.uint8).data_ptr() % 4096 == 0


def configure(user_setting: str | None, tensor_first: bool) -> list[bool]:
    """In a new interpreter: the user's switch (None: unset), maybe a tensor first, then
    ``configure_allocator``; what it returned and what a later 4 MiB buffer shows."""
    os.environ.pop(_SWITCH, None)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if user_setting is not None:
        os.environ[_SWITCH] = user_setting
    if tensor_first:
        import torch

        torch.zeros(1)
    from hyfi_imaging.parallel.memory import configure_allocator

    threshold, huge = configure_allocator()
    return [threshold, huge, _page_aligned()]


def command_help(name: str) -> bool:
    """In a new interpreter: ``hyfi-<name> --help``, then whether buffers have huge pages."""
    os.environ.pop(_SWITCH, None)
    cli = importlib.import_module(f"hyfi_imaging.cli.{name}")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    return _page_aligned()


def test_a_rank_gets_huge_pages_and_the_fixed_threshold() -> None:
    assert in_fresh_process("test_allocator", "configure", None, False) == [True, True, True]


def test_the_users_own_switch_is_kept() -> None:
    assert in_fresh_process("test_allocator", "configure", "0", False) == [True, False, False]


def test_too_late_after_the_first_tensor_is_reported_not_hidden() -> None:
    # PyTorch has decided already: nothing changes, and the function says so.
    assert in_fresh_process("test_allocator", "configure", None, True) == [True, False, False]


@pytest.mark.parametrize("name", ["train", "verify", "predict"])
def test_each_command_sets_the_allocator_up_before_its_first_tensor(name: str) -> None:
    assert in_fresh_process("test_allocator", "command_help", name) is True


def described(set_up: bool) -> str:
    """In a new interpreter: :func:`allocator`'s line, with or without the set-up first."""
    os.environ.pop(_SWITCH, None)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    from hyfi_imaging.parallel.memory import allocator, configure_allocator

    if set_up:
        configure_allocator()
    return allocator()


def test_the_allocator_is_described_as_set_up() -> None:
    """The speed model keeps this CPU's calibration per allocator (its page faults differ)."""
    assert in_fresh_process("test_allocator", "described", True) == (
        "mmap threshold 65536, huge pages on"
    )
    assert in_fresh_process("test_allocator", "described", False) == (
        "mmap threshold adaptive, huge pages off"
    )


def planned() -> str:
    """In a new interpreter: ``hyfi-plan`` once, then :func:`allocator`'s line."""
    os.environ.pop(_SWITCH, None)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    from hyfi_imaging.cli.plan import main
    from hyfi_imaging.parallel.memory import allocator

    args = ["--model", "resnet18", "--width", "0.25", "--image-size", "256", "--devices", "1"]
    assert main([*args, "--top", "1", "--device", "h100"]) == 0
    return allocator()


def test_hyfi_plan_calibrates_under_the_ranks_allocator() -> None:
    """What a new buffer costs the ranks is what this CPU's calibration must measure."""
    assert in_fresh_process("test_allocator", "planned") == "mmap threshold 65536, huge pages on"
