"""`rebar.openmp_team`: a thread's team size, set without touching any other thread's."""

from __future__ import annotations

import threading

import torch

from needs import need_linux_proc, requires
from rebar import openmp_team


def in_a_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


@requires(need_linux_proc)  # the runtime is found among /proc/self/maps
def test_a_thread_sets_its_own_team_and_no_other() -> None:
    assert openmp_team.available()
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:

        def cut() -> tuple[int, int]:
            start = torch.get_num_threads()
            assert openmp_team.set_team_size(1)
            return start, torch.get_num_threads()

        assert in_a_thread(cut) == (3, 1)
        assert torch.get_num_threads() == 3  # this thread's is untouched
        assert in_a_thread(torch.get_num_threads) == 3  # and so is what a new thread starts with
    finally:
        torch.set_num_threads(before)
