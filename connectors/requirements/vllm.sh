# PyPI's torchvision/torchaudio/torchcodec are CUDA builds; with them installed,
# `from transformers import LlamaConfig` fails ("operator torchvision::nms does not exist").
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
