"""megatron-focus: Focus and XSA attention for Megatron-Core GPT pretraining."""

import warnings

# Megatron-Core warns at import that Apex / Transformer Engine are absent; we do not use them.
# Set here, before any megatron_focus module imports megatron, for every entry point at once.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
