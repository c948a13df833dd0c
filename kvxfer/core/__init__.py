"""The pure domain: layouts, model profiles, planning and the recompute rule.

No I/O, no clock, no nixl, no protobuf: everything here is a function of frozen
dataclasses, which is where most of kvxfer's tests live.
"""
