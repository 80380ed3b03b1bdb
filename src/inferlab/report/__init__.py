"""The report: every result.json under outputs/ -> one CSV -> tables, PNG charts and the Markdown report."""
