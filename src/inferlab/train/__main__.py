"""python -m inferlab.train: the same as inferlab-train."""

from inferlab.train.main import main

main()
