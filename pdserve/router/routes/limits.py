"""The admission middleware's defaults (routes/admission.py), apart from it: `pdserve`'s flag
parser shows them in every process it starts, and node processes never load FastAPI."""

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_MAX_QUEUED_REQUESTS = 1024
