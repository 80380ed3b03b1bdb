"""python -m inferlab.report: the same as inferlab-report."""

from inferlab.report.build import main

main()
