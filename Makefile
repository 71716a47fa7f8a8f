.PHONY: test serve proto
test:
	scripts/test.sh
serve:
	python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/kvstore serve
proto:
	.venv/bin/python scripts/gen_proto.py
