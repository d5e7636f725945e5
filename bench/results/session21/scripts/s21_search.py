"""Session 21: bit orders for the mma decode of a word of 8 e2m1 codes. The decode needs codes Q and Q + 4
at bf16 bits 6..8 and 15 of the low and high half (mask 0x81C081C0). 1. No four rotations r_Q (r_0 = 0)
place disjoint copies of the mask over the 32 bits (so no order decodes every pair with a rotation and a
mask). 2. Three rotations and, for the 8 bits left, a masking, a multiply by a 3-bit constant and a
masking (checked carry-free over all 256 values of those bits): prints the solutions (3, 6, 0x1084 is
fp4_tiles.SWIZZLED_BIT's)."""
import itertools
MASK=0x81C081C0
P=[b for b in range(32) if MASK>>b&1]
def rot(S,s): return {(p+s)%32 for p in S}
four=[S for S in itertools.combinations(range(1,32),3)
      if len(set().union(*(rot(P,s) for s in (0,)+S)))==32]
print("four rotations:", len(four))
sols=[]
for s1 in range(1,32):
  A=set(P); B=rot(P,s1)
  if A&B: continue
  for s2 in range(s1+1,32):
    C=rot(P,s2)
    if (A|B)&C: continue
    L=set(range(32))-A-B-C
    # pair3 via (w & L) * M & MASK, M with 2 or 3 bits; check exhaustively over the 8 leftover bits
    Ls=sorted(L)
    for nb in (2,3):
      for cs in itertools.combinations(range(32),nb):
        M=sum(1<<c for c in cs)
        # need: the 8 leftover bits map bijectively onto P positions under x*M & MASK, for all 256 inputs
        # find image of each single bit
        img={}
        good=True
        for b in Ls:
          v=((1<<b)*M)&0xFFFFFFFF&MASK
          if bin(v).count('1')!=1: good=False;break
          img[b]=v.bit_length()-1
        if not good or sorted(img.values())!=P: continue
        # verify linearity (no carries) over all inputs
        for x in range(256):
          w=sum(1<<Ls[i] for i in range(8) if x>>i&1)
          exp=sum(1<<img[Ls[i]] for i in range(8) if x>>i&1)
          if ((w*M)&0xFFFFFFFF&MASK)!=exp: good=False;break
        if good: sols.append((s1,s2,hex(M),Ls))
print(len(sols)); print(sols[:10])
