"""Reading one checkpoint: verification against its manifest (no torch needed) and the
tensor readers (one pass over the bytes).
"""
