"""python -m inferlab.bench: the same as inferlab-bench."""

from inferlab.bench.main import main

main()
