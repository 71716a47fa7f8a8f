.PHONY: test serve proto
test:
	scripts/test.sh
serve:
	@echo "make serve: [1/3] creating .venv"
	python3 -m venv .venv
	@echo "make serve: [2/3] installing kvstore and its dependencies into .venv (half a minute or more the first time; pip names each package as it goes)"
	.venv/bin/pip install .
	@echo "make serve: [3/3] installed; starting kvstore serve"
	.venv/bin/kvstore serve
proto:
	.venv/bin/python scripts/gen_proto.py
