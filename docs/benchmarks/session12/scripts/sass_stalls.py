"""(twelfth session, a record) Sums the stall counts that ptxas wrote into the control bits of each
SASS instruction (bits 41..44 of the high word: the cycles the scheduler waits before the warp's
next instruction) over an address range of a `cuobjdump -sass` listing, by opcode:

    python3 sass_stalls.py kernel.sass 3380 6b30 [v]     # hex addresses; v lists each instruction
"""
import re,sys
lines=open(sys.argv[1]).read().splitlines()
ins=[]
i=0
pat=re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/')
hi=re.compile(r'^\s*/\* (0x[0-9a-f]+) \*/\s*$')
while i < len(lines):
    m=pat.search(lines[i])
    if m and i+1 < len(lines) and hi.match(lines[i+1]):
        h=int(hi.match(lines[i+1]).group(1),16)
        stall=(h>>41)&0xF; yld=(h>>45)&1; wb=(h>>46)&7; rb=(h>>49)&7; wmask=(h>>52)&0x3F
        ins.append((int(m.group(1),16),m.group(2).strip(),stall,yld,wb,rb,wmask))
        i+=2
    else: i+=1
lo,hi_=int(sys.argv[2],16),int(sys.argv[3],16)
tot=0
from collections import Counter
c=Counter()
for a,t,s,y,wb,rb,wm in ins:
    if lo<=a<=hi_:
        tot+=s; op=t.split()[0] if not t.startswith('@') else t.split()[1]
        c[op.split('.')[0]]+=s
        if len(sys.argv)>4: print(f"{a:05x} s{s:2d} wm{wm:02x} {t}")
print("total stall", tot, "n", sum(1 for a,*_ in ins if lo<=a<=hi_))
print(c.most_common(15))
