"""Images of chat requests, read on the worker: fetched (`fetch.py`), decoded (`decode.py`) under the worker's
`MediaPolicy` (`policy.py`), and each failure a `MediaError` naming the part, which fails its request alone.

Imports nothing itself: `policy.py` (read by the CLI's flags) imports neither Pillow nor torch.
"""
