#!/usr/bin/env bash
# poll.sh SECS BUDGET [short]: wait up to SECS for /tmp/r25/DONE; BUDGET = the session's device time
# left when this call began: when A ends, GO_B if >= 430 s would remain, else NO_B. Packs /tmp/r25
# into $OUT/r25.tgz at the end.
R=/tmp/r25; T=$1; B=$2
[ "${3:-}" = short ] && touch "$R/SHORT" && echo "poll: SHORT set"
end=$((SECONDS+T))
while [ $SECONDS -lt $end ] && [ ! -f $R/DONE ]; do
  if [ -f $R/A_DONE ] && [ ! -f $R/GO_B ] && [ ! -f $R/NO_B ]; then
    left=$((B - SECONDS))
    if [ $left -ge 430 ]; then touch $R/GO_B; else touch $R/NO_B; fi
    echo "poll: $(date +%T) A done, ~$left s of device time left: $(ls $R | grep -E '^(GO_B|NO_B)$')"
  fi
  sleep 5
done
echo "poll: $(date +%T) after $SECONDS s; DONE: $([ -f $R/DONE ] && echo yes || echo no)"
tail -n 30 $R/session.log
tail -c 1500 $R/session.out
df -h /tmp | tail -n1
tar czf $OUT/r25.tgz -C /tmp r25 && ls -la $OUT
