import sys, runpy
import zerocore.snapshot as S
S.mirror_offsets = lambda nodes, copies: []
sys.argv = ["snapshot_bench.py", *sys.argv[1:]]
runpy.run_path("bench/snapshot_bench.py", run_name="__main__")
