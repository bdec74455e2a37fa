"""Adapters to serving engines' own extension points.

Each adapter lives in its own module (``tiercache.integrations.sglang``, ...)
and imports its engine; import the module you need. Nothing in tiercache
imports an adapter, and this package imports no engine.
"""
