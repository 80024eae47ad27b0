"""The control of growth.sh: what the kernel charges a process for touching fresh memory,
without any of ntl-patch's code.

Maps `MB` MiB of anonymous memory, asks for transparent huge pages on it as ntl-patch's
allocator (mimalloc) does on its arenas (`madvise(MADV_HUGEPAGE)`; `small` leaves 4 KiB pages),
writes one byte per 4 KiB page and prints the user, system and elapsed seconds and the page
faults that took (`--bare`: the three times only, for growth.sh's table). growth.sh runs it
right after each patch run, at that run's peak RSS, so the time the kernel takes to hand out
that much fresh memory is measured beside the commands'.

    python scripts/bench/touch_memory.py MB [huge|small] [--bare]
"""
import mmap
import resource
import sys
import time


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--bare"]
    mb = int(args[0])
    pages = args[1] if len(args) > 1 else "huge"
    size = mb << 20
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if pages == "huge":
        memory.madvise(mmap.MADV_HUGEPAGE)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for offset in range(0, size, 4096):
        memory[offset] = 1
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    if "--bare" in sys.argv:
        print(f"{user:.3f} {system:.3f} {elapsed:.3f}")
        return
    print(
        f"{mb} MiB {pages}: user {user:.3f} s, system {system:.3f} s, elapsed {elapsed:.3f} s, "
        f"faults {after.ru_minflt - before.ru_minflt}"
    )


if __name__ == "__main__":
    main()
