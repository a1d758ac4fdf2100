#!/usr/bin/env bash
# On a GPU machine (the device tool): train the quality model, then `conduit eval` it with pages seen
# in earlier sessions (in-context KV) and seen alone (isolated KV). Results under $OUT.

python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
(bash -c 'source tools/gpu_build.sh' > $OUT/build.log 2>&1 &)
python3 -m quality.train --out /tmp/qrun --minutes 6.4 --curriculum 0.25 --log-every 200 --stale-requests 64 > $OUT/train.log 2>&1
tail -c 1500 $OUT/train.log
(cd /tmp/qrun && tar czf - model metrics.json | split -b 15M - $OUT/model.tgz.part)
export CONDUIT_LIB=/tmp/conduit-build/libconduit.so; ls -la $CONDUIT_LIB
for seen in sessions isolated; do
  timeout 170 python3 -m conduit_rt.evaluation --model /tmp/qrun/model --device cuda --n 500 --workers 6 --time-limit 95 --seen $seen --out /tmp/eval_$seen > $OUT/eval_$seen.log 2>&1 &
done
wait
for seen in sessions isolated; do tail -3 $OUT/eval_$seen.log; (cd /tmp/eval_$seen && tar czf $OUT/eval_$seen.tgz results.json table.md plot.png quality.md); done
