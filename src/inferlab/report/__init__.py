"""The report: every result.json under outputs/ -> one CSV -> tables, PNG charts and the Markdown report."""

from importlib.util import find_spec

MISSING = [name for name in ("pandas", "matplotlib", "tabulate") if find_spec(name) is None]
if MISSING:  # an extra: serving, generating and benchmarking run without them
    raise ModuleNotFoundError(f"inferlab's report needs {', '.join(MISSING)}: pip install 'inferlab[report]'")
