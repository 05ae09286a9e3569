"""bench/kernel_times.py's grouping of a kernel's device times by launch position (CPU)."""

from kernel_times import per_launch_medians


def test_two_launches_per_call_are_told_apart():
    # three calls, each launching the kernel twice: a slow first launch, a fast second
    times = [9.0, 2.0, 10.0, 1.0, 11.0, 3.0]
    assert per_launch_medians(times, iters=3) == (2, [10.0, 2.0])


def test_one_launch_per_call():
    assert per_launch_medians([5.0, 4.0, 6.0, 100.0], iters=4) == (1, [6.0])
