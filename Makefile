.PHONY: test serve proto
test:
	scripts/test.sh
serve:
	@echo "make serve: installing kvstore and its dependencies into .venv (half a minute or more the first time)"
	python3 -m venv .venv && .venv/bin/pip install -q . && echo "make serve: installed; starting kvstore serve" \
		&& .venv/bin/kvstore serve
proto:
	.venv/bin/python scripts/gen_proto.py
