"""``rlbus run``: the launcher that supervises a whole run on one machine (session), with its status
panel, eval coordinator, report, group accounting and metrics writer. Nothing in the pipeline imports it.
"""
