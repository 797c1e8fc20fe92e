"""Storage: the only layer that talks to fsspec. Durable and create-only writes, reads that
refuse what is not a regular file, checksums, and what a storage error means.
"""
