"""Prompt-cache linter: finds what breaks prefix caching in request logs (timestamps, ids,
key order, tool lists, settings, breakpoint misuse, fan-out) and simulates vendor costs.
"""
