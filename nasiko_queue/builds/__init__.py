"""
Build jobs, the original's port: payload types, the build store, the executor
pipeline and terminalization of targets.
"""
