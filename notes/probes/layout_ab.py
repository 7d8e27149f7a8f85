"""ResBlock forward + backward with FLAME's channels-last choice on and off, in one process
(torch.compile as the peer both times): does channels-last pay on the ResBlock?"""

import json
import sys

import flame as fl
from bench import conv_attention as bench

timing = bench.Timing(warmup=5, calls=20, repeats=5)
cases = [(32, 128, 32, 512), (32, 256, 16, 512), (32, 512, 8, 512)]
report = {}
for choice in (True, False):
    fl.backends.cudnn.channels_last = choice
    section = bench.resblock_section("cuda", cases, timing)
    for row in section["rows"]:
        print(f"channels_last={choice}", json.dumps(row)[:600])
    report[str(choice)] = section
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file, indent=1, default=str)
