"""Bounds on what a request may ask for: the one home of every limit that the schemas check, the engine
checks again (`worker.engine.api`) and the README's field table states.

Plain constants, no imports: the engine reads them without pydantic, the docs without anything.
Why bounds at all: the engine packs these values into int32 and float32 step buffers and scans stop strings
every step, so one absurd value must fail its line, not a step.
"""

MAX_NEW_TOKENS_LIMIT = 2**20
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty|: OpenAI's range is [-2, 2]
MAX_TOP_K = 1_000_000  # larger than any vocabulary: a top_k at or above the vocab size keeps every token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1  # fits the engine's int32 token buffers
MAX_PROMPT_TOKEN_IDS = 2**20  # a prompt given as token ids
MAX_PROMPTS = 128  # prompts in one completions request (each a choice group of its output)
MIN_SEED = -(2**63)  # a seed is any int64, as OpenAI takes it
MAX_SEED = 2**63 - 1
MAX_REPETITION_PENALTY = 100.0  # vLLM asks only > 0; a finite cap keeps the float32 logits finite
MAX_LOGIT_BIAS = 100.0  # |bias| per token: OpenAI's range, where vLLM clamps
MAX_LOGIT_BIAS_TOKENS = 1024  # token ids in one logit_bias
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary has tokens
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat bound)
MAX_PROMPT_LOGPROBS = 20  # top alternatives per prompt token (vLLM's default `max_logprobs`)
MAX_CHOICES = 1024  # strings in a `choice` list
MAX_SAMPLES = 128  # `n`: parallel samples per request (OpenAI's bound)
MAX_TOOLS = 128  # tools in a chat body (OpenAI's bound)
MAX_TOOL_CALLS = 128  # per assistant message in an input transcript
MAX_CUSTOM_ID_CHARS = 512
MAX_TEMPLATE_KWARGS = 16  # names in chat_template_kwargs
MAX_TEMPLATE_STRING_CHARS = 256  # a string value in chat_template_kwargs
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's bound)
MAX_EMBEDDING_DIMENSIONS = 65536  # `dimensions`; the model's own dimension bounds it further
MAX_IMAGES_PER_REQUEST = 16  # image parts in one chat request (the worker's --limit-mm-per-prompt may lower it)
MAX_IMAGE_URL_CHARS = 32 * 2**20  # an image part's url: a base64 data URL of about 24 MB at most
