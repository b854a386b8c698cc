import torch, fsharded as fs
from fsharded import P

def megatron():
    torch.manual_seed(0)
    dt=torch.float64
    mesh = fs.Mesh({'data': 2, 'tensor': 2})
    B, D, H = 8, 4, 8
    x = torch.randn(B, D, dtype=dt); w1 = torch.randn(D, H, dtype=dt); w2 = torch.randn(H, D, dtype=dt)
    def local(w1, w2, x):
        x = fs.pvary(x, 'tensor')
        return fs.psum(torch.tanh(x @ w1) @ w2, 'tensor')
    sm = fs.shard_map(local, mesh=mesh, in_specs=(P(None,'tensor'), P('tensor',None), P('data',None)), out_specs=P('data',None), check_rep=True)
    y = sm(w1, w2, x)
    a,b,c=[t.clone().requires_grad_() for t in (w1,w2,x)]
    sm(a,b,c).pow(2).sum().backward()
    def inner(w1, w2, x):
        g = torch.func.grad(lambda *a: local(*a).pow(2).sum(), argnums=(0,1,2))(w1,w2,x)
        return fs.psum(g[0], 'data'), fs.psum(g[1],'data'), g[2]
    sm2 = fs.shard_map(inner, mesh=mesh, in_specs=(P(None,'tensor'), P('tensor',None), P('data',None)), out_specs=(P(None,'tensor'), P('tensor',None), P('data',None)), check_rep=True)
    return y, (a.grad, b.grad, c.grad), sm2(w1,w2,x)
