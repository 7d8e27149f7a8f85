"""Does reading stored cuDNN plans release the GIL? (Could a process's first reads overlap the
trace on a background thread?)

    FLAME_CACHE_DIR=DIR python3 notes/probes/cudnn_read_gil.py write LIST   # a warm step, its plans listed
    FLAME_CACHE_DIR=DIR python3 notes/probes/cudnn_read_gil.py main LIST    # fresh process: read them here
    FLAME_CACHE_DIR=DIR python3 notes/probes/cudnn_read_gil.py thread LIST  # fresh: read on a thread
                                                                         # while this one counts

``thread`` prints how many iterations a pure-Python loop made while the reads ran, against
the same loop's rate alone: a rate near 1.0 means the reads ran beside Python (GIL released).
"""

import json
import sys
import threading
import time

import cupy

from flame.runtime import library_cudnn


def spin(seconds: float, stop=None) -> int:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        for _ in range(1000):
            count += 1
    return count


def main(mode: str, path: str) -> None:
    cupy.cuda.runtime.free(0)
    if mode == "write":
        import flame as fl
        from bench.diffusion_cases import flame_batch, flame_trainer

        with fl.backend("cuda"):
            trainer = flame_trainer(("unet", "full", 32, 64))
            trainer.compiled(*flame_batch(32, 64))
            fl.synchronize()
        entries = [(made.key, made.key[1]) for made in library_cudnn._PLANS.values()]
        with open(path, "w") as file:
            file.write(library_cudnn.encode_entries(entries).decode())
        print(json.dumps({"plans": len(entries)}))
        return
    import ast

    entries = [tuple(item) for item in ast.literal_eval(open(path).read())]
    library_cudnn._load()  # the session first, apart
    rate = spin(0.3) / 0.3
    started = time.perf_counter()
    if mode == "main":
        read = library_cudnn.preload(entries)
        print(json.dumps({"mode": mode, "read": read, "ms": (time.perf_counter() - started) * 1e3}))
        return
    done = threading.Event()
    result = {}

    def reader():
        result["read"] = library_cudnn.preload(entries)
        result["ms"] = (time.perf_counter() - started) * 1e3
        done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    count = spin(30.0, done)
    spun = time.perf_counter() - started
    thread.join()
    print(json.dumps({"mode": mode, **result, "python_rate_during": count / spun / rate}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
