"""python -m inferlab.loadgen: the same as inferlab-loadgen."""

from inferlab.bench.loadgen import main

if __name__ == "__main__":
    main()
