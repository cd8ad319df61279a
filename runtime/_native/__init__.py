"""Skiff's private native code (built from runtime/_native/src by scikit-build-core).

Nothing here is public API: use the typed facade in `runtime.stream`.
"""
