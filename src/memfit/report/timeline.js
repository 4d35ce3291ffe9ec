(function(){
const D = JSON.parse(document.getElementById('memfit-data').textContent);
const S = D.strings, W = 1100, PH = 260, LH = 34, L = 64, R = 16, T = 10;
const tip = document.getElementById('tip');
function fmt(n){const u=[['TiB',2**40],['GiB',2**30],['MiB',2**20],['KiB',2**10]];
  for(const [name,s] of u){if(n>=s){const v=n/s;return v.toFixed(v<10?2:v<100?1:0)+' '+name;}}return n+' B';}
function where(m){return m===null?'(outside any module)':(m===''?'(root)':m);}
function esc(x){return String(x).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'})[c]);}
function draw(t, host){
  const c = document.createElement('canvas'), dpr = window.devicePixelRatio||1, H = T+PH+LH+26;
  c.width=W*dpr; c.height=H*dpr; c.style.width=W+'px'; c.style.height=H+'px'; host.appendChild(c);
  const g=c.getContext('2d'); g.scale(dpr,dpr);
  const pw=W-L-R, n=Math.max(1,t.n), top=D.top*1.1||1;
  const X=k=>L+k/n*pw, Y=v=>T+PH-v/top*PH;
  for(const [a,b,p] of t.phases){const col=D.phaseColors[D.phases[p]]; if(!col) continue;
    g.fillStyle=col; g.globalAlpha=0.08; g.fillRect(X(a),T,X(b)-X(a),PH); g.globalAlpha=1;}
  const ncol=t.rep.length, base=new Float64Array(ncol);
  t.cats.forEach((ci,j)=>{ const v=t.stack[j]; g.fillStyle=D.colors[ci]; g.beginPath(); g.moveTo(X(t.edges[0]),Y(base[0]));
    for(let i=0;i<ncol;i++){ g.lineTo(X(t.edges[i]),Y(base[i]+v[i])); g.lineTo(X(t.edges[i+1]),Y(base[i]+v[i])); }
    for(let i=ncol-1;i>=0;i--){ g.lineTo(X(t.edges[i+1]),Y(base[i])); g.lineTo(X(t.edges[i]),Y(base[i])); }
    g.closePath(); g.fill(); for(let i=0;i<ncol;i++) base[i]+=v[i]; });
  for(const [name,v,col] of t.lines){ g.strokeStyle=col; g.lineWidth=1.4; if(name.startsWith('reserved')) g.setLineDash([6,3]);
    g.beginPath(); for(let i=0;i<ncol;i++){ const y=Y(v[i]); if(i===0) g.moveTo(X(t.edges[0]),y); else g.lineTo(X(t.edges[i]),y); g.lineTo(X(t.edges[i+1]),y); }
    g.stroke(); g.setLineDash([]); g.lineWidth=1; }
  g.fillStyle='rgba(214,39,40,0.18)'; for(const [a,b] of t.recompute) g.fillRect(X(a),T,Math.max(X(b)-X(a),1),PH);
  g.strokeStyle='#888'; g.beginPath(); g.moveTo(L,T); g.lineTo(L,T+PH); g.lineTo(L+pw,T+PH); g.stroke();
  g.fillStyle='#333'; g.font='10px sans-serif'; g.textAlign='right';
  const unit=top>=2**30?2**30:2**20, uname=unit===2**30?' GiB':' MiB', raw=top/unit/5, mag=10**Math.floor(Math.log10(raw));
  const step=[1,2,2.5,5,10].map(m=>m*mag).find(m=>m>=raw)*unit;
  for(let v=0;v<=top;v+=step){ g.fillText(String(+(v/unit).toFixed(3))+uname, L-4, Y(v)+3);
    g.strokeStyle='rgba(0,0,0,0.08)'; g.beginPath(); g.moveTo(L,Y(v)); g.lineTo(L+pw,Y(v)); g.stroke(); }
  g.textAlign='center'; for(let f=0;f<=1.001;f+=0.2){ g.fillText(String(Math.round(f*t.n)), X(f*t.n), T+PH+LH+14); }
  if(D.budget){ g.strokeStyle='#d62728'; g.setLineDash([5,3]); g.beginPath(); g.moveTo(L,Y(D.budget)); g.lineTo(L+pw,Y(D.budget)); g.stroke(); g.setLineDash([]);
    g.fillStyle='#d62728'; g.textAlign='left'; g.fillText('budget '+fmt(D.budget), L+4, Y(D.budget)-3); }
  if(t.peak[0]>=0){ const x=X(t.peak[0]+0.5); g.strokeStyle='#000'; g.setLineDash([2,2]); g.beginPath(); g.moveTo(x,T); g.lineTo(x,T+PH); g.stroke(); g.setLineDash([]);
    g.fillStyle='#000'; g.beginPath(); g.moveTo(x-5,Y(t.peak[1])-8); g.lineTo(x+5,Y(t.peak[1])-8); g.lineTo(x,Y(t.peak[1])-1); g.fill(); }
  const ly=T+PH+4;
  if(t.kind==='trace'){ let big=1; for(const m of t.marks) big=Math.max(big,m[1]);
    if(!t.marks.length){ g.fillStyle='#555'; g.textAlign='center'; g.fillText('no segment made or released during the trace',L+pw/2,ly+LH/2+3); }
    g.textAlign='right'; g.fillStyle='#555'; g.fillText('made',L-4,ly+LH/4+3); g.fillText('released',L-4,ly+3*LH/4+3);
    for(const [e,b,sg] of t.marks){ const y=sg>0?ly:ly+LH/2, h=Math.max(2,(LH/2-3)*b/big); g.fillStyle=sg>0?'#6a3d9a':'#999';
      g.fillRect(X(e+0.5)-0.5,y+LH/2-2-h,1.2,h); } }
  for(const [a,b,name,p] of t.lane){ const y=D.phases[p]==='forward'?ly:ly+LH/2; g.fillStyle=D.phaseColors[D.phases[p]]||'#999';
    g.fillRect(X(a),y,Math.max(X(b)-X(a)-0.5,0.5),LH/2-2);
    const label=(S[name]||'').split('.').pop(); if(X(b)-X(a)>label.length*6+4){g.fillStyle='#fff'; g.textAlign='center'; g.fillText(label,(X(a)+X(b))/2,y+LH/4+3);} }
  g.fillStyle='#d62728'; for(const [a,b] of t.recompute) g.fillRect(X(a),ly+LH-6,Math.max(X(b)-X(a),1),4);
  c.addEventListener('mousemove', e=>{
    const r=c.getBoundingClientRect(), mx=e.clientX-r.left, my=e.clientY-r.top;
    if(mx<L||mx>L+pw||my<T||my>T+PH){tip.style.display='none';return;}
    const k=(mx-L)/pw*n; let lo=0, hi=ncol-1; while(lo<hi){const m=(lo+hi+1)>>1; if(t.edges[m]<=k) lo=m; else hi=m-1;}
    const i=lo, tick=t.rep[i], v=(T+PH-my)/PH*top; let acc=0, cj=-1;
    for(let j=0;j<t.cats.length;j++){ if(v<acc+t.stack[j][i]){cj=j;break;} acc+=t.stack[j][i]; }
    const ctx=t.ctx[i], tr=t.kind==='trace', word=tr?'event':'tick';
    let h=tr?'<b>event '+tick+'</b> ('+esc(S[ctx[2]])+')<br>':'<b>tick '+tick+'</b> ('+D.phases[ctx[0]]+', '+esc(S[ctx[2]])+' in '+esc(where(S[ctx[1]]))+')<br>';
    let total=0; for(let j=0;j<t.cats.length;j++) total+=t.stack[j][i]; h+=(tr?'allocated: ':'alive: ')+fmt(total);
    if(t.edges[i+1]-t.edges[i]>1) h+=' (highest of '+word+'s '+t.edges[i]+'..'+(t.edges[i+1]-1)+')';
    for(const [name,v] of t.lines) h+='<br>'+esc(name)+': '+fmt(v[i]);
    if(cj>=0){ const ci=t.cats[cj]; h+='<br>'+D.cats[ci]+': '+fmt(t.stack[cj][i]); let found=null;
      for(const b of t.blocks){ if(b[3]!==ci||b[0]>tick||b[1]<=tick) continue; if(v<acc+b[2]){found=b;break;} acc+=b[2]; }
      if(found&&tr){ const b=found; h+='<hr><b>block '+fmt(b[2])+'</b> ('+b[2]+' bytes), '+esc(D.cats[b[3]])+'<br>allocated at:<br>'+esc(S[b[4]]).replace(/\n/g,'<br>')+
        '<br>born: '+(b[0]<0?'before the trace':'event '+b[0])+'<br>freed: '+(b[8]<0?'alive at the dump':'event '+b[1]); }
      else if(found){ const b=found; h+='<hr><b>block '+fmt(b[2])+'</b> ('+b[2]+' bytes), '+D.cats[b[3]]+'<br>module: '+esc(where(S[b[4]]))+
        '<br>born: '+(b[0]<0?'before the step':'tick '+b[0]+' ('+D.phases[b[6]]+', '+S[b[5]]+')')+
        '<br>freed: '+(b[8]<0?'outlives the step':'tick '+b[1]+' ('+D.phases[b[8]]+', '+S[b[7]]+')'); }
      else h+='<br>(smaller blocks here: not listed)'; }
    tip.innerHTML=h; tip.style.display='block'; tip.style.left=(e.pageX+14)+'px'; tip.style.top=(e.pageY+10)+'px'; });
  c.addEventListener('mouseleave', ()=>{tip.style.display='none';});
}
const host=document.getElementById('charts');
for(const t of D.tracks){ const h=document.createElement('h3'); h.textContent=t.label+': '+t.peakText; host.appendChild(h); draw(t, host); }
// #hover=TRACK,FX,FY points at a fraction of a track's plot: what a test (or a link) shows
const hv=/^#hover=(\d+),([\d.]+),([\d.]+)$/.exec(location.hash);
if(hv){ const c=host.querySelectorAll('canvas')[+hv[1]], r=c.getBoundingClientRect();
  c.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+L+(+hv[2])*(W-L-R),clientY:r.top+T+PH-(+hv[3])*PH,bubbles:true})); }
document.getElementById('memfit-status').textContent='rendered';
document.body.setAttribute('data-memfit','ok');
})();
